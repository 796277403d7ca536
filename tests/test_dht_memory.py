"""What dht remembers, bounded: one warning per cause, and the signature verdicts of records read again."""

from __future__ import annotations

import threading

from dht.once import OncePer


def test_first_is_true_once_per_key_and_never_past_the_capacity():
    once = OncePer(2)
    assert once.first("a") and not once.first("a")
    assert once.first("b")
    assert not once.first("c"), "past the capacity: forged causes must not grow memory or the log"


def test_threads_see_each_key_first_exactly_once():
    once, firsts = OncePer(1000), []
    threads = [
        threading.Thread(target=lambda: firsts.extend(k for k in range(100) if once.first(k))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(firsts) == list(range(100))


def test_the_signature_validator_remembers_verdicts_by_the_records_bytes(monkeypatch):
    """A node reads the same signed records every few seconds: their verdicts are remembered, but a record that
    differs in any signed byte (its value, its expiration) is checked afresh, and memory stays bounded."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from dht.validation import SignatureValidator

    author = SignatureValidator(RSAPrivateKey())
    unsigned = DHTRecord(b"key", author.local_public_key, b"value", get_dht_time() + 60)
    signed = DHTRecord(unsigned.key, unsigned.subkey, author.sign_value(unsigned), unsigned.expiration_time)
    reader = SignatureValidator(RSAPrivateKey(), remember=2)
    calls = []
    check = RSASignatureValidator.validate  # hivemind's own, counted

    def counted(self, record):
        calls.append(record)
        return check(self, record)

    monkeypatch.setattr(RSASignatureValidator, "validate", counted)
    assert reader.validate(signed) and reader.validate(signed) and len(calls) == 1
    tampered = DHTRecord(signed.key, signed.subkey, signed.value.replace(b"value", b"valuf"), signed.expiration_time)
    prolonged = DHTRecord(signed.key, signed.subkey, signed.value, signed.expiration_time + 1)
    assert not reader.validate(tampered) and not reader.validate(prolonged) and len(calls) == 3
    assert len(reader._verdicts) == 2, "only the last `remember` verdicts are kept"
    assert reader.validate(signed) and len(calls) == 4, "forgotten, so checked again"
