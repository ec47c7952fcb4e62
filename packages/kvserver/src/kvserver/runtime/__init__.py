"""The kvserver process: builds every part from the config and serves them.

The ZMQ transport and the one dispatch over typed requests, `describe`, latency buckets, the expiry
sweeper. The only subpackage that may import all the others.
"""
