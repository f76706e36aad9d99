// Updates of a manager's SeedCounter (sr.cuh), queued on the stream of the SR kernels that read it:
// SET sets {base, step, micro-step 0, mode, no completed step}; NEXT_MICRO advances the micro-step;
// NEXT_STEP records the finished step's micro-steps in `done` and starts the next step. The host
// names the ops by these constants (lowgrad/sr/seedcounter.py reads them here).
#include "sr.cuh"

enum : u32 { SET = 0, NEXT_MICRO = 1, NEXT_STEP = 2 };

extern "C" __global__ void __launch_bounds__(256) seed_counter(SeedCounter* c, u32 op, u64 base, u32 step, u32 mode) {
  if (threadIdx.x | blockIdx.x) return;
  if (op == SET) {
    c->base = base;
    c->step = step;
    c->micro = 0;
    c->mode = mode;
    c->done = 0;
  } else if (op == NEXT_MICRO) {
    c->micro += 1;
  } else {
    c->done = c->micro + 1;
    c->step += 1;
    c->micro = 0;
  }
}
