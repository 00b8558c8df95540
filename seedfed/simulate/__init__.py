"""`seedfed simulate`: a coordinator and a fleet of virtual devices in one process tree.

    config.py    the typed run configuration, the recipe and data it names
    driver.py    the run: the coordinator, the task, the round loop on either engine
    scoring.py   held-out accuracy of committed versions, the per-round report rows
    report.py    report.json's rows and report.png
    progress.py  the console: expected duration, progress bar, summary tables
"""
