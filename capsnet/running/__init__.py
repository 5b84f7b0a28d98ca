"""Training and evaluating a model: the run folder and its lock (runs), the
position a run resumes from (run_state), what the loop records (recording),
a process's role in its run (roles), stopping on a signal (stopping), weight
averaging (averaging), scoring (evaluation), the cluster (cluster_spec,
distributed), and how a program starts (startup, files)."""
