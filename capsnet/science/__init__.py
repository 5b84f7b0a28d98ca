"""The studies' science: the grids and their runs (grids), the protocols
along training (along) and confirmatory (confirm), the answer across
protocols (answer), a study's report from its runs' files (report) and the
statistics the protocols call with (stats). Their command lines are the
programs capsnet/study.py, along.py, confirm.py and answer.py."""
