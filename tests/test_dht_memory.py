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


def test_the_swarm_validator_remembers_what_it_accepted_and_still_checks_the_clock(monkeypatch):
    """A record read again is not parsed again, but its times are checked against the clock every time: one that
    was fine when first read and is not now is refused. A record that differs in a byte is checked afresh."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from test_dht_records import ANNOUNCE_TTL, rules, stage

    import dht.validation as validation
    from dht import ephemeral_identity, key_id

    swarm = rules()
    author = ephemeral_identity()
    record = stage(author)
    now = get_dht_time()

    def dht_record(value: dict, expiration: float) -> DHTRecord:
        key = key_id(record.key(swarm.keys))
        return DHTRecord(key, MSGPackSerializer.dumps(author.owner_tag), MSGPackSerializer.dumps(value), expiration)

    reader = validation.SwarmRecordValidator(swarm, remember=2)
    parsed = []
    check = validation.check_record

    def counted(*args):
        parsed.append(args)
        return check(*args)

    monkeypatch.setattr(validation, "check_record", counted)
    fresh = dht_record(record.dict(), now + 60)
    assert reader.validate(fresh) and reader.validate(fresh) and len(parsed) == 1
    later = dht_record(record.dict(), now + 61)
    assert reader.validate(later) and len(parsed) == 2, "another expiration is another record"
    # another clock (a TTL earlier): the same bytes were written in its future and outlive any announcement
    monkeypatch.setattr(validation, "get_dht_time", lambda: now - ANNOUNCE_TTL)
    assert not reader.validate(fresh) and len(parsed) == 2, "remembered, and refused on its times alone"
    monkeypatch.setattr(validation, "get_dht_time", get_dht_time)
    assert reader.validate(fresh) and len(parsed) == 2
    assert len(reader._accepted) == 2
    other = dht_record(stage(author, last_step=3).dict(), now + 60)
    assert reader.validate(other) and len(parsed) == 3 and len(reader._accepted) == 2, "bounded"
