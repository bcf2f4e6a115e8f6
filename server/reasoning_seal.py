"""Restorable reasoning blobs: Anthropic thinking `signature`s and Responses `encrypted_content` (api.md §4.2, §5).

A client that echoes a thinking block (even one sent with ``display: "omitted"``, whose text is empty) or a
reasoning item must let us restore the exact ``reasoning_content`` we generated, so the next prompt renders
byte-identically and hits the prefix cache (§7). The blob is a versioned, MAC-protected, compressed copy of the
raw reasoning:

    "tdm1." + base64url(mac[16] + zlib(reasoning utf-8))      mac = HMAC-SHA256(key, "tdm1" + zlib bytes)

A blob that does not verify (another server's key, a restart with a fresh key, a real Anthropic signature, a
truncated copy) opens to None; the caller then uses the text the client sent.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import zlib

VERSION = "tdm1"
MAC_BYTES = 16
MAX_REASONING_BYTES = 64 * 2**20      # refuse to inflate more than this (a verified blob never is)


class ReasoningSeal:
    """Seals reasoning text into an opaque string and opens it again. Keyed: blobs from another key fail."""

    def __init__(self, key: bytes | None = None):
        self._key = key if key is not None else secrets.token_bytes(32)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, VERSION.encode() + body, hashlib.sha256).digest()[:MAC_BYTES]

    def seal(self, reasoning: str) -> str:
        """The blob for `reasoning`; deterministic for a given key (streamed == non-streamed)."""
        body = zlib.compress(reasoning.encode("utf-8"), 6)
        return f"{VERSION}.{base64.urlsafe_b64encode(self._mac(body) + body).decode().rstrip('=')}"

    def open(self, blob: object) -> str | None:
        """The reasoning sealed in `blob`, or None if it is not a valid blob of this key."""
        if not isinstance(blob, str) or not blob.startswith(VERSION + "."):
            return None
        text = blob[len(VERSION) + 1:]
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return None
        mac, body = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(body)):
            return None
        try:
            inflater = zlib.decompressobj()
            data = inflater.decompress(body, MAX_REASONING_BYTES)
            if inflater.unconsumed_tail:
                return None
            return data.decode("utf-8")
        except (zlib.error, UnicodeDecodeError):
            return None
