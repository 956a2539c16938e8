"""dscore-example-layout: a checkpoint layout with one safetensors shard per rank plus a manifest."""
