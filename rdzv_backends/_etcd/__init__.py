"""What the etcd v2 and v3 backends share; no module here imports an etcd client library.

* :mod:`.settings` -- the URL's settings (endpoints, TLS files, credentials, ``operation_timeout``), TTL rounding,
  the capabilities both backends declare;
* :mod:`.tls` -- TLS files checked when the URL is parsed, one handshake at open;
* :mod:`.budget` -- an operation's deadline shared by the attempts of its requests, a watch's failure budget,
  what a retried compare-guarded write knows (:class:`~.budget.Tries`);
* :mod:`.endpoints` -- which endpoint of a multi-host URL to try next;
* :mod:`.errors` -- the errors both backends raise for the same conditions.
"""
