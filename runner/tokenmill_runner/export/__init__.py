"""`tokenmill export`: a run's committed rows as a trainer's input (SpecForge, speculators, Hugging Face datasets).

Pure: `units` (generation units from committed rows), `filters`, `formats` (records per format), `specforge_rules`
(what SpecForge does to a conversation), `roundtrip` (the check that a text record gives back the stored ids),
`manifest` (counts, export.json, summary). I/O: `writers` (files into the destination), `source_lines` (prompts by
line), `exporter` (the stream from committed shards to files). docs/export.md describes the formats.
"""
