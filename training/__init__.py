"""Offline tools for the gateway: training the request classifier (numpy).

    python -m training.classify_train --out gateway/classify/weights.json

Nothing in `gateway/` imports this package: the gateway only reads the weights file it writes
(`gateway/classify/weights.json`), in pure Python. It imports the runtime's feature extraction
(`gateway.classify_features`) so that training and serving compute the same features.
"""
