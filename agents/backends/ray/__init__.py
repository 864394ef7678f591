"""The ``ray`` execution backend: a node's workers as Ray actors pinned to that node's Ray node.

Built up in parts; today it holds the connection to the Ray cluster (``connection``).
"""
