"""The peer society: who is who, routing choice, strikes and exclusion."""
