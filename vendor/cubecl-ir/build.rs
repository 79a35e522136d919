// smp-burn's vendored copy: announce `TmaOps::BulkReduceAddF32` to direct dependents, whose
// build scripts read it as DEP_CUBECL_IR_SMP_BURN_BULK_REDUCE_ADD_F32.
fn main() {
    println!("cargo:bulk_reduce_add_f32=1");
}
