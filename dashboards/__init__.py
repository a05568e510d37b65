"""The live dashboard (Dash) over a run directory: ``fsdp-doctor dashboard PATH``.

* :mod:`dashboards.state` follows the run directory (``RunFollower``, incremental by file offsets) and keeps
  the report current: the record analyses are rebuilt when new records arrive, trace windows are analysed
  once per file on a background thread.
* :mod:`dashboards.figures` holds pure figure builders (plain data in, ``plotly`` figures out).
* :mod:`dashboards.pages` lays out each page from the report; :mod:`dashboards.app` wires it together.
"""
