"""The rollout server (`grpokit rollout`): HTTP endpoints, the served engine, the receiving side of weight sync."""
