"""Headers of every dashboard response: a Content-Security-Policy without 'unsafe-inline' (the
pages' scripts are files under /ui/static, their data JSON blocks that are never executed), and
the usual hardening. Added by app/front.py to the responses of the pages under /ui."""

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
]
