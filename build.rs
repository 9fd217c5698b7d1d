//! Compiles the small C++ shim over libtorch's TorchScript module API (named buffers are not
//! exposed by tch) and its AOTInductor package loader, and embeds libtorch's folder as the
//! binary's rpath.
fn main() {
    // torch-sys (`links = "tch"`) exports the folder it linked libtorch from.
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys did not report libtorch's folder; run `make setup` first");
    let lib = std::path::PathBuf::from(lib);
    let root = lib.parent().expect("libtorch lib folder has a parent");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!(
            "-D_GLIBCXX_USE_CXX11_ABI={}",
            std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into())
        ))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        // Where the shim finds `libtorch.so` when a compiled package needs it (dm_package_load).
        .define(
            "DM_LIBTORCH_SO",
            format!("{:?}", lib.join("libtorch.so").display().to_string()).as_str(),
        )
        .file("src/ffi/module_shim.cpp")
        .compile("diffmon_shim");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rerun-if-changed=src/ffi/module_shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
}
