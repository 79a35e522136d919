// smp-burn's vendored copy: announce what it adds to direct dependents, whose build scripts
// read it as DEP_CUBECL_IR_SMP_BURN_BULK_REDUCE_ADD_F32 (`TmaOps::BulkReduceAddF32`) and
// DEP_CUBECL_IR_SMP_BURN_WGMMA (`TmaOps::Wgmma*`).
fn main() {
    println!("cargo:bulk_reduce_add_f32=1");
    println!("cargo:wgmma=1");
}
