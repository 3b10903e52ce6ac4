"""Statistics over token lengths and latencies: distributions, percentiles and drift tests (`distributions`),
exact integer histograms and latency sketches that merge across shards (`histograms`). Pure numpy; used by the
live run (its length histogram) and by the report. Imports no other stage.
"""
