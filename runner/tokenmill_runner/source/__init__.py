"""Where a prompt comes from: source files (JSONL, Parquet, shard folders; local or S3) read line by line
(`reader`), turned into the canonical row by format adapters (`adapters`), validated into a `Prompt` or a
`RowError` naming its line (`prompts`), and scanned once before the stream for duplicate ids and the work split
(`scan`, `duplicates`, `scan_cache`). Imports only `store` (for storage) and the layers below it.
"""
