"""The swarm's records in the hivemind DHT: key schema, signed record models, validators, typed get/put."""
