"""Speed and memory benchmarks of medusa_train: measurements, not part of the product (the wheel leaves them out).

Run from the repository root: ``python -m benchmarks NAME key=value ...`` (``python -m benchmarks --help`` lists them).
"""
