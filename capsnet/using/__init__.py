"""Using what training made: the SavedModel export (serving) and the
pictures eval.py draws (pictures)."""
