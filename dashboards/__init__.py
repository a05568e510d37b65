"""The live dashboard (Dash) over a run directory: ``fsdp-doctor dashboard PATH``.

* :mod:`fsdp_doctor.dashboards.state` follows the run directory (``RunFollower``, incremental by file offsets) and keeps
  the report current: the record analyses are rebuilt when new records arrive, trace windows are analysed
  once per file on a background thread.
* :mod:`fsdp_doctor.dashboards.figures` holds pure figure builders (plain data in, ``plotly`` figures out).
* :mod:`fsdp_doctor.dashboards.pages` lays out each page from the report; :mod:`fsdp_doctor.dashboards.app` wires it together.
"""
