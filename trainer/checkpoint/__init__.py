"""Checkpoints, one concept: the file and its atomic writing (file.py), what a training checkpoint holds
(state.py), finding where to resume and checking it can (resume.py), and the run folder that holds a run's
checkpoints, config and metrics (run_folder.py)."""
