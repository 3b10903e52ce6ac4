"""The output: where committed work lives and how it is read back. `storage` is the one edge to local disk and S3;
`shards` writes a shard's data, its errors and then its commit marker (`marker_names` orders them by time);
`ledger` folds markers into one bit per slot (dataset, line, sample index); `commit_index`, `checkpoints` and
`index_store` keep that fold incremental and resumable; `packed` is the digest-checked binary format they share;
`lease` keeps one writer and `seals` makes a taken-over writer's late markers count for nobody; `faults` holds
the test-only kill points of the commit protocol. Imports only `facts` and `stats` below it.
"""
