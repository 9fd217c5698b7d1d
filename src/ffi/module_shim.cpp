// A small C ABI over libtorch's TorchScript module, for what tch does not expose: the module's
// buffers (normalization statistics, fixed tables) next to its parameters, and a forward that
// checks the model contract's output shape. Tensors cross the boundary as `torch::Tensor*`
// allocated with `new`, the representation tch uses, so Rust takes ownership with
// `tch::Tensor::from_ptr`.
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

char *copy_message(const std::string &message) {
  char *out = static_cast<char *>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.c_str(), message.size() + 1);
  }
  return out;
}

}  // namespace

// Runs `body`, turning a C++ exception into an error message and `on_error`.
template <typename R, typename F>
R guarded(char **err, R on_error, F body) {
  try {
    return body();
  } catch (const c10::Error &e) {
    *err = copy_message(e.what_without_backtrace());
  } catch (const std::exception &e) {
    *err = copy_message(e.what());
  }
  return on_error;
}

extern "C" {

typedef void (*dm_named_tensor_cb)(void *data, const char *name, torch::Tensor *tensor);
typedef void (*dm_device_constant_cb)(void *data, const char *device, const char *op,
                                      const char *method);

void dm_free_string(char *s) { std::free(s); }

// device_index < 0: CPU; otherwise the CUDA device of that index.
void *dm_module_load(const char *path, int device_index, char **err) {
  return guarded<void *>(err, nullptr, [&]() -> void * {
        torch::Device device = device_index < 0
                                   ? torch::Device(torch::kCPU)
                                   : torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device_index));
        auto *module = new torch::jit::Module(torch::jit::load(path, device));
        module->eval();
        return module;
      });
}

void dm_module_free(void *module) { delete static_cast<torch::jit::Module *>(module); }

// Calls `cb` for every parameter, then every buffer, with its dotted name, and returns the number
// of parameters (-1 on error). The tensors alias the module's own storage: writing into them
// (under no-grad) changes the module.
int dm_module_named_tensors(void *module, void *data, dm_named_tensor_cb cb, char **err) {
  return guarded<int>(err, -1, [&]() -> int {
        auto *m = static_cast<torch::jit::Module *>(module);
        int params = 0;
        for (const auto &p : m->named_parameters(/*recurse=*/true)) {
          cb(data, p.name.c_str(), new torch::Tensor(p.value));
          params++;
        }
        for (const auto &b : m->named_buffers(/*recurse=*/true)) {
          cb(data, b.name.c_str(), new torch::Tensor(b.value));
        }
        return params;
      });
}

// Puts every 4-dimensional floating-point parameter and buffer of the module in the
// channels-last layout (`on`) or back in the contiguous one, in place (`set_data`: the tensors
// `dm_module_named_tensors` gave alias the same storage afterwards). Returns how many changed
// layout (-1 on error).
int dm_module_channels_last(void *module, int on, char **err) {
  return guarded<int>(err, -1, [&]() -> int {
        auto *m = static_cast<torch::jit::Module *>(module);
        torch::NoGradGuard no_grad;
        const auto format = on != 0 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
        int changed = 0;
        auto convert = [&](at::Tensor t) {
          if (t.dim() == 4 && t.is_floating_point() && !t.is_contiguous(format)) {
            t.set_data(t.contiguous(format));
            changed++;
          }
        };
        for (const auto &p : m->named_parameters(/*recurse=*/true)) {
          convert(p.value);
        }
        for (const auto &b : m->named_buffers(/*recurse=*/true)) {
          convert(b.value);
        }
        return changed;
      });
}

// Turns bfloat16 autocast on for `device` (this thread's dispatch state) while it lives, and
// restores what was there before.
class Bf16Autocast {
 public:
  Bf16Autocast(c10::DeviceType device, bool on) : device_(device), on_(on) {
    if (on_) {
      enabled_ = at::autocast::is_autocast_enabled(device_);
      dtype_ = at::autocast::get_autocast_dtype(device_);
      at::autocast::set_autocast_dtype(device_, at::kBFloat16);
      at::autocast::set_autocast_enabled(device_, true);
      at::autocast::increment_nesting();
    }
  }
  ~Bf16Autocast() {
    if (on_) {
      if (at::autocast::decrement_nesting() == 0) {
        at::autocast::clear_cache();
      }
      at::autocast::set_autocast_enabled(device_, enabled_);
      at::autocast::set_autocast_dtype(device_, dtype_);
    }
  }

 private:
  c10::DeviceType device_;
  bool on_;
  bool enabled_ = false;
  at::ScalarType dtype_ = at::kFloat;
};

// forward(x, sigma) must return a tuple (denoised, features) of two tensors. With `bf16`, the
// forward runs under bfloat16 autocast on x's device, and both outputs come back as float32.
// With `channels_last`, x goes in in the channels-last layout, and both outputs come back
// contiguous.
int dm_module_forward(void *module, torch::Tensor *x, torch::Tensor *sigma, int bf16,
                      int channels_last, torch::Tensor **denoised, torch::Tensor **features,
                      char **err) {
  return guarded<int>(err, -1, [&]() -> int {
        auto *m = static_cast<torch::jit::Module *>(module);
        torch::NoGradGuard no_grad;
        const bool nhwc = channels_last != 0 && x->dim() == 4;
        std::vector<torch::jit::IValue> inputs{
            nhwc ? x->contiguous(at::MemoryFormat::ChannelsLast) : *x, *sigma};
        torch::jit::IValue out;
        {
          Bf16Autocast autocast(x->device().type(), bf16 != 0);
          out = m->forward(inputs);
        }
        if (!out.isTuple()) {
          *err = copy_message("forward returned " + out.tagKind() +
                              ", expected a tuple (denoised, features)");
          return -1;
        }
        const auto &elements = out.toTupleRef().elements();
        if (elements.size() != 2 || !elements[0].isTensor() || !elements[1].isTensor()) {
          std::string kinds;
          for (const auto &e : elements) {
            kinds += (kinds.empty() ? "" : ", ") + e.tagKind();
          }
          *err = copy_message("forward returned a tuple of (" + kinds +
                              "), expected (denoised: Tensor, features: Tensor)");
          return -1;
        }
        auto as_float = [&](const torch::Tensor &t) {
          auto out = bf16 != 0 && t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
          return nhwc ? out.contiguous() : out;
        };
        *denoised = new torch::Tensor(as_float(elements[0].toTensor()));
        *features = new torch::Tensor(as_float(elements[1].toTensor()));
        return 0;
      });
}

// Calls `cb` for every device constant in the graphs of the module's methods and of its
// submodules' methods (nested blocks included): the device it names, the kind of the first node
// using it (`aten::ones`) and the method's qualified name. A traced graph holds one where the
// traced code passed a device (`torch.ones(..., device=t.device)`), and then runs only there.
// Returns how many were found (-1 on error).
int dm_module_device_constants(void *module, void *data, dm_device_constant_cb cb, char **err) {
  return guarded<int>(err, -1, [&]() -> int {
        auto *m = static_cast<torch::jit::Module *>(module);
        int found = 0;
        for (const auto &sub : m->modules()) {
          for (const auto &method : sub.get_methods()) {
            std::string name = method.function().qualname().qualifiedName();
            std::vector<torch::jit::Block *> blocks{method.graph()->block()};
            while (!blocks.empty()) {
              torch::jit::Block *block = blocks.back();
              blocks.pop_back();
              for (torch::jit::Node *node : block->nodes()) {
                for (torch::jit::Block *inner : node->blocks()) {
                  blocks.push_back(inner);
                }
                if (node->kind() != c10::prim::Constant || node->outputs().size() != 1 ||
                    node->output()->type()->kind() != c10::TypeKind::DeviceObjType) {
                  continue;
                }
                auto value = torch::jit::toIValue(node->output());
                std::string device = value && value->isDevice() ? value->toDevice().str() : "?";
                const auto &uses = node->output()->uses();
                std::string op = uses.empty() ? "(unused)" : uses[0].user->kind().toQualString();
                cb(data, device.c_str(), op.c_str(), name.c_str());
                found++;
              }
            }
          }
        }
        return found;
      });
}

// The libtorch release this binary was built against, `MAJOR.MINOR.PATCH` (a compiled package
// runs only on the release that compiled it).
const char *dm_torch_version() {
  static const std::string version = std::to_string(TORCH_VERSION_MAJOR) + "." +
                                     std::to_string(TORCH_VERSION_MINOR) + "." +
                                     std::to_string(TORCH_VERSION_PATCH);
  return version.c_str();
}

// An AOTInductor package (`.pt2`): libtorch unpacks it into a temporary folder and loads the
// shared object inside (native code: the caller decides whether the file is trusted first).
// Only what torch 2.11 and 2.13 both declare is called: the five-argument constructor, run,
// get_constant_fqns and the three-argument load_constants.
// The package's shared object needs `libtorch.so`, which nothing else of diffmon uses: linking it
// into the binary would load libtorch's CUDA libraries into every diffmon process (hundreds of
// MB), so it is loaded here, globally, only when a package is (then the package's own dlopen
// finds it by its name).
void *dm_package_load(const char *path, int device_index, char **err) {
  return guarded<void *>(err, nullptr, [&]() -> void * {
    if (dlopen(DM_LIBTORCH_SO, RTLD_NOW | RTLD_GLOBAL) == nullptr &&
        dlopen("libtorch.so", RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char *why = dlerror();
      throw std::runtime_error(std::string("cannot load libtorch.so for the compiled package: ") +
                               (why ? why : "unknown error"));
    }
    return new torch::inductor::AOTIModelPackageLoader(
        path, "model", /*run_single_threaded=*/false, /*num_runners=*/1,
        static_cast<c10::DeviceIndex>(device_index));
  });
}

void dm_package_free(void *package) {
  delete static_cast<torch::inductor::AOTIModelPackageLoader *>(package);
}

typedef void (*dm_name_cb)(void *data, const char *name);

// Calls `cb` with the original name (`conv_in.weight`) of every weight the package takes, and
// returns how many (-1 on error).
int dm_package_weight_names(void *package, void *data, dm_name_cb cb, char **err) {
  return guarded<int>(err, -1, [&]() -> int {
    auto *p = static_cast<torch::inductor::AOTIModelPackageLoader *>(package);
    int n = 0;
    for (const auto &name : p->get_constant_fqns()) {
      cb(data, name.c_str());
      n++;
    }
    return n;
  });
}

// Copies `n` tensors into the package's weights of those names (the active buffer, in place:
// no recompilation, no reload). The tensors must be on the package's device.
int dm_package_load_weights(void *package, int n, const char *const *names,
                            torch::Tensor *const *tensors, char **err) {
  return guarded<int>(err, -1, [&]() -> int {
    auto *p = static_cast<torch::inductor::AOTIModelPackageLoader *>(package);
    std::unordered_map<std::string, at::Tensor> weights;
    for (int i = 0; i < n; i++) {
      weights.emplace(names[i], *tensors[i]);
    }
    p->load_constants(weights, /*use_inactive=*/false, /*check_full_update=*/false);
    return 0;
  });
}

// forward(x, sigma) of the compiled contract: two outputs, (denoised, features).
int dm_package_forward(void *package, torch::Tensor *x, torch::Tensor *sigma,
                       torch::Tensor **denoised, torch::Tensor **features, char **err) {
  return guarded<int>(err, -1, [&]() -> int {
    auto *p = static_cast<torch::inductor::AOTIModelPackageLoader *>(package);
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> out = p->run({*x, *sigma});
    if (out.size() != 2) {
      *err = copy_message("the compiled package returned " + std::to_string(out.size()) +
                          " outputs, expected 2 (denoised, features)");
      return -1;
    }
    *denoised = new torch::Tensor(out[0]);
    *features = new torch::Tensor(out[1]);
    return 0;
  });
}

// TF32 off for cuDNN convolutions and cuBLAS matrix products (libtorch's default leaves it on
// for cuDNN), so CUDA computes in float32 as the CPU does; `on` turns both on.
void dm_set_tf32(int on) {
  at::globalContext().setAllowTF32CuDNN(on != 0);
  at::globalContext().setAllowTF32CuBLAS(on != 0);
}

// CUDA's caching allocator, through c10's device-generic allocator interface (libc10 and its
// headers only: no CUDA header is needed to build, and a CPU-only libtorch answers with an
// error). `out` gets, in bytes: allocated now, allocated at the peak, reserved at the peak
// (reserved: what the allocator holds from the GPU, cached blocks included).
int dm_cuda_memory(int device, int64_t *out, char **err) {
  return guarded(err, 1, [&] {
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)
                     ->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].peak;
    return 0;
  });
}

// The peaks of `dm_cuda_memory` start again from the current values.
int dm_cuda_reset_peak(int device, char **err) {
  return guarded(err, 1, [&] {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)
        ->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  });
}

// Gives the cached blocks no tensor uses back to the GPU (torch.cuda.empty_cache()).
int dm_cuda_empty_cache(char **err) {
  return guarded(err, 1, [&] {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache();
    return 0;
  });
}

}  // extern "C"
