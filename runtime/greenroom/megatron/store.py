class ShardStore:
    pass
