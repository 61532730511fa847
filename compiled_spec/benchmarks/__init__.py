"""`compiled-spec bench`: tokens/s, step latency and acceptance per graph mode, k and batch size, beside transformers.

sweep.py plans the cells and runs each in a fresh process (worker.py); engine_cell.py and anchors.py measure
one cell; report.py writes the table and plots.
"""
