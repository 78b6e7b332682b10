"""The check of one GPU node (check.sh) and the wheels it installs where the node's Python lacks them."""
