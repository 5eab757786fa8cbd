// A decode step compiled ahead of time (engine/aot_steps.py), run through torch's dispatcher without Python's lock.
//
// torch's own binding of the package loader (torch._C._aoti.AOTIModelPackageLoader.run) keeps the GIL for the whole
// step: in the server every other Python thread, the event loop that streams the tokens among them, then waits for
// the step's end, and its work per token is added between steps instead of running beside them. An op called
// through torch.ops runs with the GIL released, as every kvserve kernel does, so the step is held here as a custom
// class and run by one.
#include <ATen/core/Dict.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace kvserve {
namespace {

// Its methods are those of torch's binding, by name and arguments, so that engine/aot_steps.py treats both alike.
struct CompiledStep : torch::CustomClassHolder {
  torch::inductor::AOTIModelPackageLoader loader;

  // The package's folder (unpacked: read where it lies), for the CPU, one runner.
  explicit CompiledStep(const std::string& path) : loader(path, "model", false, 1, -1) {}

  std::vector<std::string> get_constant_fqns() { return loader.get_constant_fqns(); }

  void load_constants(const c10::Dict<std::string, at::Tensor>& constants, bool use_inactive, bool check_full_update,
                      bool user_managed) {
    std::unordered_map<std::string, at::Tensor> named;
    for (const auto& entry : constants) named.emplace(entry.key(), entry.value());
    loader.load_constants(named, use_inactive, check_full_update, user_managed);
  }
};

std::vector<at::Tensor> run_step(const c10::intrusive_ptr<CompiledStep>& step, const std::vector<at::Tensor>& inputs) {
  return step->loader.run(inputs);
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve::CompiledStep>("CompiledStep")
      .def(torch::init<std::string>())
      .def("get_constant_fqns", &kvserve::CompiledStep::get_constant_fqns)
      .def("load_constants", &kvserve::CompiledStep::load_constants);
  m.def("run_step(__torch__.torch.classes.kvserve.CompiledStep step, Tensor[] inputs) -> Tensor[]", &kvserve::run_step);
}
