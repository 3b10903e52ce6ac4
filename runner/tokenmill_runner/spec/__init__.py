"""What the user asked for: the DatasetGeneration resource as pydantic models (`resource`; the CRD in `crds/` is
generated from it) and the runner's configuration, the spec plus what this process is (`config`). The boundary
models every stage above reads; they import only `source.adapters` (the input layout) and `facts` (releases).
"""
