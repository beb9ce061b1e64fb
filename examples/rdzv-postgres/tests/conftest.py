"""The server controller behind ``{server:postgres}``, for this plugin's own tests."""

from rdzv_postgres.testing import rdzv_server_postgres  # noqa: F401  (session fixture)
