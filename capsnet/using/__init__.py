"""Using what training made: the SavedModel export (serving), the pictures
eval.py draws (pictures), a study's report from its runs' files (report)
and the statistics it reports (stats)."""
