"""Using what training made: the SavedModel export (serving), the pictures
eval.py draws (pictures), and the statistics the study reports (stats)."""
