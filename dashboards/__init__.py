"""The live dashboard (Dash) over a run directory: ``fsdp-doctor dashboard PATH``.

* :mod:`fsdp_doctor.dashboards.state` follows the run directory (``RunFollower``, incremental by file offsets) and keeps
  the report current: the record analyses are rebuilt when new records arrive, trace windows are analysed
  once per file on a background thread.
* The figure builders are :mod:`fsdp_doctor.present.figures` (shared with the HTML report).
* :mod:`fsdp_doctor.dashboards.pages` lays out each page from the report; :mod:`fsdp_doctor.dashboards.app` wires it together.
"""
