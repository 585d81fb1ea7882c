"""What a run reports: the progress line, metrics.jsonl, TensorBoard scalars (metrics.py), and the loss and
memory plots it leaves in its run_dir, written as SVG (charts.py)."""
