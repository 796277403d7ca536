"""The swarm's config as a DHT record, how a joiner picks it, and records of the previous schema."""

from __future__ import annotations

import pytest
from hivemind.utils import get_dht_time

from dht import CONFIG_KEY, RecordError, SwarmKeys, check_record, ephemeral_identity, parse_record
from dht.records import SCHEMA, StageAnnouncement
from dht.validation import key_id
from sentinel_node.config import load_config
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.swarm_config import Published, SwarmConfigError, config_of, config_record, read_published, resolve

PUBLISHER = ephemeral_identity()
TINY, DEMO = load_config(None), load_config(DEMO_CONFIG_PATH)


def test_a_published_config_reads_back_as_the_same_config_on_any_swarms_nodes():
    record = config_record(DEMO, PUBLISHER.peer_id)
    assert record.key(SwarmKeys("anything")) == CONFIG_KEY and record.prefix == "sentinel-demo"
    now = get_dht_time()
    # any swarm's validators take it under the shared key (a joiner's node validates what it reads as what it
    # stores), signed by its publisher, within a config record's lifetime
    for rules in (DEMO.swarm_rules(), TINY.swarm_rules()):
        checked = check_record(rules, key_id(CONFIG_KEY), PUBLISHER.owner_tag, record.dict(), now + 600, now)
        assert config_of(checked) == DEMO and config_of(checked).swarm_hash() == DEMO.swarm_hash()
    with pytest.raises(RecordError, match="speaks for"):
        check_record(DEMO.swarm_rules(), key_id(CONFIG_KEY), ephemeral_identity().owner_tag, record.dict(), now, now)
    with pytest.raises(RecordError, match="may live"):
        check_record(DEMO.swarm_rules(), key_id(CONFIG_KEY), PUBLISHER.owner_tag, record.dict(), now + 10**6, now)


class Records:
    """A store's config reads, without a DHT (the read's choice of publisher is under test)."""

    def __init__(self, records):
        self.records = records

    def swarm_configs(self, timeout=None):
        return self.records


def test_a_joiner_takes_the_config_of_the_bootstrap_it_dialed_over_a_strangers():
    stranger = ephemeral_identity().peer_id
    records = {PUBLISHER.peer_id: config_record(DEMO, PUBLISHER.peer_id), stranger: config_record(TINY, stranger)}
    dialed = [f"/ip4/127.0.0.1/tcp/4100/p2p/{PUBLISHER.peer_id}"]
    assert resolve(read_published(Records(records), initial_peers=dialed), None, "ADDR") == DEMO
    # dialed some other peer: both configs count, and the joiner refuses to guess
    with pytest.raises(SwarmConfigError, match="2 different configs"):
        resolve(read_published(Records(records), initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/QmOther"]), None, "ADDR")


def test_an_altered_config_is_refused_by_its_hash():
    record = config_record(DEMO, PUBLISHER.peer_id)
    altered = record.replace(config=record.config.replace('"lr":0.003', '"lr":0.3'))
    with pytest.raises(SwarmConfigError, match="either it was altered"):
        config_of(altered)
    with pytest.raises(SwarmConfigError, match="not a valid config"):
        config_of(record.replace(config='{"model": {"n_layers": -1}}'))


def test_a_joiner_runs_the_config_its_publishers_agree_on_and_refuses_another_naming_both_hashes():
    others = [ephemeral_identity().peer_id for _ in range(2)]
    agreed = Published.of({p: config_record(DEMO, p) for p in [PUBLISHER.peer_id, others[0]]})
    assert resolve(agreed, None, "ADDR") == DEMO
    assert resolve(agreed, DEMO, "ADDR") == DEMO
    with pytest.raises(SwarmConfigError) as refused:
        resolve(agreed, TINY, "ADDR", "--config tiny.yaml")
    message = str(refused.value)
    assert TINY.swarm_hash() in message and DEMO.swarm_hash() in message and "--config tiny.yaml" in message
    split = Published.of(
        {PUBLISHER.peer_id: config_record(DEMO, PUBLISHER.peer_id), others[1]: config_record(TINY, others[1])}
    )
    with pytest.raises(SwarmConfigError, match="2 different configs"):
        resolve(split, None, "ADDR")
    assert resolve(split, TINY, "ADDR") == TINY  # the file names one of them
    with pytest.raises(SwarmConfigError, match="publishes no config"):
        resolve(Published.of({}), None, "ADDR")
    assert resolve(Published.of({}), TINY, "ADDR") == TINY  # an older bootstrap: nothing to compare with


def test_a_record_of_the_previous_schema_reads_without_the_fields_that_came_later():
    new = StageAnnouncement(
        peer_id=PUBLISHER.peer_id,
        maddrs=[],
        state="online",
        relayed=False,
        throughput=1.0,
        stage=0,
        config_hash="h",
        version="old",
        time=1.0,
    ).dict()
    old = {k: v for k, v in new.items() if k not in ("name", "network")} | {"schema": SCHEMA - 1}
    read = parse_record(old)
    assert read.network == 0.0 and read.name is None
    # a record of today's schema must carry them, as before
    with pytest.raises(ValueError, match="conversions or defaults"):
        parse_record({k: v for k, v in new.items() if k != "network"})
    with pytest.raises(ValueError, match="malformed"):
        parse_record({**new, "name": "<script>"})
