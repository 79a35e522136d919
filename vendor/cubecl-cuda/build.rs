use cudarc::driver::sys::CUDA_VERSION;

fn main() {
    // smp-burn's vendored copy: announce `CudaServer::launch_stream` to direct dependents,
    // whose build scripts read it as DEP_CUBECL_CUDA_SMP_BURN_LAUNCH_STREAM.
    println!("cargo:launch_stream=1");
    println!("cargo::rustc-check-cfg=cfg(cuda_12050)");
    println!("cargo::rustc-check-cfg=cfg(cuda_12080)");

    if CUDA_VERSION >= 12050 {
        println!("cargo:rustc-cfg=cuda_12050");
    }
    if CUDA_VERSION >= 12080 {
        println!("cargo:rustc-cfg=cuda_12080");
    }
}
