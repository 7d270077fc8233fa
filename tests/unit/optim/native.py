"""The optimizers pinned to native mode, for tests that compare exact numerics."""

from __future__ import annotations

from functools import partial

import asteria_client

SOAP = partial(asteria_client.SOAP, mode="native")
Shampoo = partial(asteria_client.Shampoo, mode="native")
KLShampoo = partial(asteria_client.KLShampoo, mode="native")
