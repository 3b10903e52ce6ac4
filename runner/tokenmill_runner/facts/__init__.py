"""Capacity facts, shared by the runner and the operator's planner: GPUs (`hardware`), SGLang releases and what
each accepts (`releases`), what a model's config implies (`model_facts`), what a server's /server_info says
(`server_info`), the throughput model and its calibration (`throughput`, `calibration`), and what a job asks of a
server (`workload`). Pure: plain data in, plain data out; the tables live in `data/`. Imports no other stage.
"""
