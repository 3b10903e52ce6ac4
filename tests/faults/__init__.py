"""Fault injection for tests: `s3_proxy.S3FaultProxy`, a proxy that breaks S3 requests by rule."""
