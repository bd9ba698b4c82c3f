// What the CPU and CUDA kernels of onnxfuse::FusedSqueezeExcite share (docs/format.md,
// FusedSqueezeExcite): the gate attribute and the inputs, read and checked the same way.
// Defined in squeeze_cpu.cc.
#pragma once

#include <vector>

#include "common.h"

namespace onnxfuse {

constexpr const char* kFusedSqueezeExcite = "FusedSqueezeExcite";

// The 'gate' attribute, parsed; checks that it and the program each map one f32 or f16
// value to one.
Program read_squeeze_gate(const OrtKernelInfo* info, const Program& prog);

// The inputs X, W1, B1, W2, B2, their types (X as the program's %0, f32_for_half as in
// type_fits; the weights X's type) and shapes checked: X rank 4 (x_nhwc: [N, H, W, C]),
// W1 [CR, C] with X's C, B1 [CR], W2 [C, CR], B2 [C].
std::vector<TensorRef> read_squeeze_inputs(OrtKernelContext* ctx, const Program& prog, bool x_nhwc,
                                           bool f32_for_half);

}  // namespace onnxfuse
