// Updates of a manager's SeedCounter (sr.cuh), queued on the stream of the SR kernels that read it:
// op 0 sets {base, step, micro-step 0, mode}; op 1 advances the micro-step; op 2 starts the next step.
#include "sr.cuh"

extern "C" __global__ void __launch_bounds__(256) seed_counter(SeedCounter* c, u32 op, u64 base, u32 step, u32 mode) {
  if (threadIdx.x | blockIdx.x) return;
  if (op == 0) {
    c->base = base;
    c->step = step;
    c->micro = 0;
    c->mode = mode;
    c->pad = 0;
  } else if (op == 1) {
    c->micro += 1;
  } else {
    c->step += 1;
    c->micro = 0;
  }
}
