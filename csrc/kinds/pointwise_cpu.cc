// CPU kernel of onnxfuse::PointwiseChain (docs/format.md): the node's program over the
// broadcast output, with the program evaluator of cpu_ops.h. float32 tensors may stand for
// f16/bf16 program values (ONNX Runtime's "isolated fp16 node").
#include <memory>

#include "cpu_ops.h"

namespace onnxfuse {
namespace {

struct CpuKernel {
  static constexpr const char* kOp = "PointwiseChain";
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  Program prog;
  std::string name;

  void compute(OrtKernelContext* ctx) const {
    Io io = bind_io(prog, ctx, /*f32_for_half=*/true);
    std::vector<HostTensor> in, out;
    for (size_t i = 0; i < io.in.size(); ++i)
      in.push_back({actual_dtype(io.in[i].type, prog.inputs[i]), io.in[i].data, io.in[i].shape});
    for (size_t j = 0; j < io.out.size(); ++j)
      out.push_back({actual_dtype(io.out[j].type, prog.outputs[j].second), io.out[j].data, io.out_shape});
    run_program(prog, in, out, io.out_shape, ctx);
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<CpuKernel>();
    k->prog = read_program(info);
    k->name = name;
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(CpuKernel::kOp, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_pointwise_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<CpuKernel>(1, create_kernel);
  ops->push_back(&op);
}

}  // namespace onnxfuse
