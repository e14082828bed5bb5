"""``rbpipe view``: the stored groups of a store in the browser, live while a run writes, or as one HTML file.

* :mod:`rbpipe.view.source`: :class:`~rbpipe.view.source.StoreView`, pages of groups, a group's members and
  the plot's numbers from the views of ``rbpipe query`` (read-only, never the writer lock);
* :mod:`rbpipe.view.rows`: the members of a few groups read straight from the store's files;
* :mod:`rbpipe.view.server`: the standard library's threading HTTP server with the page's JSON endpoints;
* :mod:`rbpipe.view.html`: the self-contained ``--html`` file;
* :mod:`rbpipe.view.page` and ``static/``: the one page both use (plotly.js from the installed package).
"""
