"""The parts of the GPU node check (bench/gpu.sh) and the wheels it installs where the node's Python lacks them."""
