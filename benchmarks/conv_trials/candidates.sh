# conv-bench candidates, most wanted first: the backward as a dx kernel (any tile) and a partials kernel
# (the package's tile), then forward tiles (bits independent of them), then the one-kernel backward designs
H=build/exp/conv1d_head.py; V4=build/exp/conv1d_v4.py
export CONV_CANDIDATES="$V4 $V4:DX_NUM_WARPS=8 $V4:DX_BLOCK_L=128,DX_NUM_WARPS=8 $V4:DX_BLOCK_L=32,DX_BLOCK_D=128,DX_NUM_WARPS=4 \
$V4:DX_BLOCK_L=32,DX_BLOCK_D=64,DX_NUM_WARPS=4 \
$H:FWD_NUM_WARPS=4 $H:FWD_NUM_WARPS=8 $H:FWD_BLOCK_L=128,FWD_NUM_WARPS=8 $H:FWD_BLOCK_L=32,FWD_BLOCK_D=128,FWD_NUM_WARPS=4 \
$H:FWD_BLOCK_L=128,FWD_BLOCK_D=128,FWD_NUM_WARPS=8 $H:FWD_BLOCK_L=32,FWD_BLOCK_D=64,FWD_NUM_WARPS=4 \
build/exp/conv1d_v3.py build/exp/conv1d_v1.py"
