"""The generation itself: `pipeline` streams prompts, keeps the servers' batches full and commits shards; `client`
talks to SGLang's /generate across replicas (`replica_health`: breakers, probes, the outage budget), `results`
reads each answer, `rows` builds the committed row, `conversation` and `tool_calls` regenerate multi-turn rows,
`seeds` and `sampling_defaults` decide what is sampled, `summary` says how the run ended (and its exit code), and
`builtin_sim` starts the simulator when no server is given.
"""
