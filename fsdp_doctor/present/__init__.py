"""Present: terminal (rich), JSON and HTML renderings of a report. Presenters format; they never analyze."""
