export NCCL_NVLS_ENABLE=0 EPX_COMMIT=ffe91ed; O=$OUT
make -j16 lib build/bin/epx_test build/bin/epx_bench > $O/build.log 2>&1 || { tail -30 $O/build.log; exit 1; }
EPX_COMBINE_SEND_DYNAMIC=0 SEND_WARPS="6" scripts/tune-combine.sh /tmp/t0 | sed 's/^/static: /'
SEND_WARPS="4 5 6" scripts/tune-combine.sh /tmp/t1 | sed 's/^/dynamic: /'
timeout 100 build/bin/epx_bench --rows ll --ll-tokens 1,128 --iters 50 --warmup 10 --sms 24 > $O/ll-bench.log 2>&1; echo "ll bench rc=$?"; grep -E "^ll " $O/ll-bench.log | cut -c1-110
timeout 420 build/bin/epx_test --ranks 2,4 > $O/tests.log 2>&1; echo "tests rc=$?"; grep -E "^\[ FAIL|FAILED" $O/tests.log | head -30; tail -1 $O/tests.log
