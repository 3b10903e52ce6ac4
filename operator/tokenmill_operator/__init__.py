"""tokenmill operator: reconciles DatasetGeneration resources (kopf)."""
