	vmulps	(%rsi,%rdx,4), %zmm4, %zmm13
	vmovdqa32	%zmm6, %zmm0
	vmulps	64(%rsi,%rdx,4), %zmm4, %zmm1
	vpsrld	$16, %zmm13, %zmm2
	vpternlogd	$202, %zmm2, %zmm1, %zmm0
	vpandd	%zmm9, %zmm0, %zmm2
	vpcmpw	$1, %zmm5, %zmm2, %k0
	vpaddw	%zmm12, %zmm0, %zmm2
	vpsrlw	$8, %zmm0, %zmm1
	vmovdqa32	%zmm11, %zmm0
	vpsrlw	$4, %zmm2, %zmm2
	vpternlogd	$202, %zmm1, %zmm2, %zmm0
	vpmovwb	%zmm0, %ymm0
	vmovaps	(%rcx,%rdx,4), %zmm15
	vmovaps	64(%rcx,%rdx,4), %zmm13
	vmovdqu	%ymm0, (%r10,%rdx)
	vmovdqa32	%zmm6, %zmm0
	vmulps	%zmm15, %zmm3, %zmm1
	vmulps	%zmm13, %zmm3, %zmm2
	vpsrld	$16, %zmm1, %zmm14
	vpternlogd	$202, %zmm14, %zmm2, %zmm0
	vpcmpw	$1, %zmm5, %zmm0, %k0
	movl	$-14332, %eax
	vpbroadcastw	%eax, %zmm1
	vpaddw	%zmm1, %zmm0, %zmm0
	vpsrlw	$3, %zmm0, %zmm0
	vpmovwb	%zmm0, %ymm0
	vmovdqu	%ymm0, (%r8,%rdx)
