"""The engine and what it is assembled from (torch lives here, never imported by ``import dscore``)."""
