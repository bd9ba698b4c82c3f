// The CUDA kernel of onnxfuse::FusedRows (docs/format.md, kind rows): launches the node's
// embedded Triton kernel. Included by cuda_ops.cc inside its anonymous namespace, after the
// driver, kernel_meta and launch helpers it uses (CudaKernelBase, Params, Target); a file of
// its own once the CUDA driver is a shared header (the fusion-kinds split).
//
// Launch (docs/format.md, kind rows): pointers to the inputs (the prologue's, then the
// epilogue's extras) and outputs (the epilogue's, then x with x_output), int32 n_rows and
// n_cols, and when some input is "strided" the `axis` leading sizes, then per strided input
// its `axis` leading strides and its stride along the row (1, or 0 when it is the same for
// the whole row); the two scratch pointers. Grid: ceil(n_rows / block_m) programs.
#pragma once

// (no includes: this file is part of cuda_ops.cc's translation unit)

enum class RowMode { FULL, LAST, SCALAR, STRIDED };

struct RowsCudaKernel : CudaKernelBase {
  static constexpr Kind kKind = Kind::ROWS;
  static constexpr const char* kOp = kFusedRows;
  RowsAttrs a;
  std::vector<RowMode> modes;  // per node input, from kernel_meta
  bool any_strided = false;

  void init(const OrtKernelInfo* info) {
    a = read_rows_attrs(info);
    // kernel_meta's kind-specific fields (the generic parse reads variants and binaries)
    std::string text;
    if (!get_string_attr(info, "kernel_meta", &text)) return;
    try {
      const Json j = Json::parse(text);
      if (j.kind != Json::OBJECT || !j.get("kind") || j.get("kind")->str != "rows") return;  // parse_meta says why
      const std::string red = meta_str(j, "reduction", "kernel_meta");
      const int64_t axis = meta_int(j, "axis", "kernel_meta");
      const int64_t n_pro = meta_int(j, "n_prologue", "kernel_meta");
      const int64_t n_ext = meta_int(j, "n_extras", "kernel_meta");
      const int64_t x_out = meta_int(j, "x_output", "kernel_meta", false, 0);
      if (axis != a.axis || n_pro != static_cast<int64_t>(a.n_prologue()) ||
          n_ext != static_cast<int64_t>(a.n_extras()) || (x_out != 0) != a.x_output)
        throw Error("kernel_meta (axis " + std::to_string(axis) + ", n_prologue " + std::to_string(n_pro) +
                    ", n_extras " + std::to_string(n_ext) + ", x_output " + std::to_string(x_out) +
                    ") does not describe this node (axis " + std::to_string(a.axis) + ", " +
                    std::to_string(a.n_prologue()) + " prologue and " + std::to_string(a.n_extras()) +
                    " epilogue inputs, x_output " + std::to_string(a.x_output ? 1 : 0) + ")");
      const char* names[] = {"layer_norm", "rms_norm", "softmax", "log_softmax"};
      if (red != names[static_cast<int>(a.reduction)])
        throw Error("kernel_meta computes " + red + ", the node " + names[static_cast<int>(a.reduction)]);
      const Json& ms = meta_array(j, "input_modes", "kernel_meta");
      if (ms.arr.size() != a.n_inputs())
        throw Error("kernel_meta has " + std::to_string(ms.arr.size()) + " input_modes for " +
                    std::to_string(a.n_inputs()) + " inputs");
      for (const Json& m : ms.arr) {
        if (m.kind != Json::STRING) throw Error("kernel_meta: input_modes must be strings");
        if (m.str == "full") modes.push_back(RowMode::FULL);
        else if (m.str == "last") modes.push_back(RowMode::LAST);
        else if (m.str == "scalar") modes.push_back(RowMode::SCALAR);
        else if (m.str == "strided") modes.push_back(RowMode::STRIDED), any_strided = true;
        else throw Error("kernel_meta: unknown input mode \"" + m.str + "\"");
      }
    } catch (const std::exception& e) {
      meta_error = e.what();
    }
  }

  // Input i read in its mode over x's shape xs: its shape checked; for "strided", its
  // leading strides and its stride along the row pushed.
  void check_mode(size_t i, const Shape& s, const Shape& xs, int64_t n_cols, Params* p) const {
    const std::string what = "input " + std::to_string(i) + " has shape " + shape_str(s) + ", its kernel reads it ";
    switch (modes[i]) {
      case RowMode::FULL:
        if (numel(s) != numel(xs)) throw Error(what + "in mode 'full', which needs x's shape " + shape_str(xs));
        return;
      case RowMode::SCALAR:
        if (numel(s) != 1) throw Error(what + "in mode 'scalar', which needs one element");
        return;
      case RowMode::LAST:
        if (numel(s) != n_cols)
          throw Error(what + "in mode 'last', which needs the shape of x's normalized dims " +
                      shape_str(Shape(xs.begin() + a.axis, xs.end())));
        return;
      case RowMode::STRIDED: {
        if (!p) return;
        const Shape st = broadcast_strides(s, xs);
        const size_t ax = static_cast<size_t>(a.axis);
        const size_t off = xs.size() - std::min(s.size(), xs.size());
        // along the row: every normalized dim read in full (contiguous), or none
        bool all = true, none = true;
        for (size_t d = ax; d < xs.size(); ++d) {
          const int64_t dim = d >= off ? s[d - off] : 1;
          all &= dim == xs[d];
          none &= dim == 1;
        }
        if (!all && !none)
          throw Error(what + "in mode 'strided', which needs it to span x's normalized dims " +
                      shape_str(Shape(xs.begin() + a.axis, xs.end())) + " or be 1 along all of them");
        for (size_t d = 0; d < ax; ++d) p->i32(st[d], "a strided input's stride");
        p->i32(none ? 0 : 1, "a strided input's stride along the row");
        return;
      }
    }
  }

  void compute(OrtKernelContext* ctx) {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_rows_inputs(a, ctx, /*f32_for_half=*/false);
    const Shape xs = rows_x_shape(a, t);
    const std::vector<TensorRef> out = rows_outputs(a, ctx, xs, /*f32_for_half=*/false);
    const int64_t total = numel(xs);
    if (total == 0) return;
    int64_t n_rows = 1;
    for (int64_t d = 0; d < a.axis; ++d) n_rows *= xs[d];
    const int64_t n_cols = total / n_rows;
    for (size_t i = 0; i < t.size(); ++i) check_mode(i, t[i].shape, xs, n_cols, nullptr);
    const Target tg = target(ctx);

    Params& p = thread_params();
    std::vector<const void*> ptrs;
    for (const TensorRef& x : t) ptrs.push_back(x.data);
    for (const TensorRef& y : out) ptrs.push_back(y.data);
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(n_rows, "the number of rows");
    p.i32(n_cols, "the row length");
    if (any_strided) {
      for (int64_t d = 0; d < a.axis; ++d) p.i32(xs[d], "a leading dim");
      for (size_t i = 0; i < t.size(); ++i)
        if (modes[i] == RowMode::STRIDED) check_mode(i, t[i].shape, xs, n_cols, &p);
    }
    p.scratch();
    const int v = choose(tg, ptrs, n_cols);
    launch(tg, v, ceil_div(n_rows, meta.variants[v].block_m), 1, p);
  }

  // The first variant with a binary for this device that accepts the row length (compiled
  // for exactly it: `cols`; single pass: at most `max_cols`) and the pointers' alignment.
  int choose(const Target& t, const std::vector<const void*>& ptrs, int64_t n_cols) const {
    for (size_t v = 0; v < meta.variants.size(); ++v) {
      const Variant& var = meta.variants[v];
      if (!t.L->fn[v] || (var.cols > 0 && var.cols != n_cols) || (var.max_cols > 0 && n_cols > var.max_cols))
        continue;
      bool aligned = true;
      for (const void* q : ptrs) aligned &= reinterpret_cast<uintptr_t>(q) % static_cast<uint64_t>(var.ptr_align) == 0;
      if (aligned) return static_cast<int>(v);
    }
    throw Error("kernel " + meta.name + ": no variant with a binary for this GPU takes rows of " +
                std::to_string(n_cols) + " elements at these addresses; embedded: " + meta.embedded());
  }
};

void after_meta(RowsCudaKernel* k) {
  if (k->meta_error.empty() && k->modes.size() != k->a.n_inputs())
    k->meta_error = "kernel_meta has no input_modes for this node";
}
