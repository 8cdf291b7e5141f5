	vmovdqu8	(%r8,%rax), %ymm2
	vmovdqu	(%r9,%rax), %ymm0
	vpmovsxbw	(%r8,%rax), %zmm30
	vpslld	$16, (%r11,%rax,2), %zmm1
	vptestnmb	%ymm25, %ymm2, %k0
	vpmovzxbw	%ymm0, %zmm26
	vpandd	(%r11,%rax,2), %zmm7, %zmm4
	vpandd	(%rcx,%rax,2), %zmm7, %zmm3
	vpslld	$20, %zmm30, %zmm28
	vpslld	$19, %zmm26, %zmm29
	vpslld	$16, (%rcx,%rax,2), %zmm31
	vpslld	$4, %zmm30, %zmm30
	vpslld	$3, %zmm26, %zmm26
	movl	$-16, %ebx
	vpbroadcastb	%ebx, %ymm2
	vptestnmb	%ymm2, %ymm0, %k0
	vmulps	%zmm1, %zmm15, %zmm0
	vpternlogd	$234, %zmm10, %zmm13, %zmm28
	movl	$133693440, %ebx
	vmulps	%zmm31, %zmm20, %zmm31
	vmovaps	%zmm28, %zmm2
	vmulps	%zmm1, %zmm0, %zmm27
	vmulps	%zmm1, %zmm17, %zmm1
	vfmadd132ps	%zmm24, %zmm1, %zmm2
	vpbroadcastd	%ebx, %zmm1
	vpternlogd	$234, %zmm10, %zmm1, %zmm29
	vmovdqa32	%zmm29, %zmm0
	vmulps	%zmm0, %zmm23, %zmm0
	vpsrld	$16, %zmm6, %zmm28
	vmulps	%zmm3, %zmm20, %zmm3
	vfmadd132ps	%zmm0, %zmm27, %zmm0
	vmulps	%zmm4, %zmm17, %zmm27
	vsqrtps	%zmm0, %zmm0
	vmovaps	%zmm0, %zmm1
	vfmadd132ps	%zmm19, %zmm18, %zmm1
	vdivps	%zmm1, %zmm2, %zmm1
	vfmadd132ps	%zmm14, %zmm31, %zmm1
	vmulps	%zmm4, %zmm15, %zmm31
	vpaddd	%zmm1, %zmm28, %zmm28
	vmulps	%zmm4, %zmm31, %zmm31
	vmovdqa32	%zmm30, %zmm4
	vpternlogd	$234, %zmm10, %zmm13, %zmm4
	vfmadd132ps	%zmm24, %zmm27, %zmm4
	movl	$133693440, %ebx
	vpbroadcastd	%ebx, %zmm30
	vpternlogd	$234, %zmm10, %zmm30, %zmm26
	vmovdqa32	%zmm26, %zmm1
	vmulps	%zmm1, %zmm23, %zmm1
	vmovaps	%zmm2, (%rdx)
	vpsrld	$16, %zmm28, %zmm28
	vrangeps	$11, %zmm4, %zmm2, %zmm2
	vmovaps	%zmm0, 1024(%rdx)
	vrangeps	$11, %zmm2, %zmm9, %zmm9
	movl	$2147450879, %ebx
	vpaddd	%zmm6, %zmm22, %zmm6
	vmovaps	%zmm4, 64(%rdx)
	vfmadd132ps	%zmm1, %zmm31, %zmm1
	vsqrtps	%zmm1, %zmm1
	vmovaps	%zmm1, %zmm26
	vmaxps	%zmm1, %zmm0, %zmm0
	vmovaps	%zmm1, 1088(%rdx)
	vfmadd132ps	%zmm19, %zmm18, %zmm26
	vmovdqa32	%zmm7, %zmm1
	vmaxps	%zmm0, %zmm8, %zmm8
	vdivps	%zmm26, %zmm4, %zmm26
	vfmadd132ps	%zmm14, %zmm3, %zmm26
	vpsrld	$16, %zmm5, %zmm3
	vpaddd	%zmm5, %zmm22, %zmm5
	vpaddd	%zmm26, %zmm3, %zmm26
	vmovdqa32	%zmm7, %zmm3
	vpternlogd	$202, %zmm28, %zmm26, %zmm3
	vmovdqu64	%zmm3, (%rcx,%rax,2)
	vmovdqu64	%zmm3, (%r12,%rax,2)
	vmulps	(%rsi,%rax,4), %zmm16, %zmm2
	vmulps	64(%rsi,%rax,4), %zmm16, %zmm3
	vpsrld	$16, %zmm2, %zmm0
	vpternlogd	$202, %zmm0, %zmm3, %zmm1
	vpbroadcastd	%ebx, %zmm0
	vpandd	%zmm0, %zmm1, %zmm0
	vpcmpw	$1, %zmm21, %zmm0, %k0
	movl	$-14328, %ebx
	vpbroadcastw	%ebx, %zmm2
	movl	$8323199, %ebx
	vpaddw	%zmm2, %zmm1, %zmm2
	vpbroadcastd	%ebx, %zmm0
	vpsrlw	$4, %zmm2, %zmm2
	vpsrlw	$8, %zmm1, %zmm1
	vpternlogd	$202, %zmm1, %zmm2, %zmm0
	vpmovwb	%zmm0, %ymm0
	vmovdqu	%ymm0, (%r10,%rax)
	vmovaps	(%rdi,%rax,4), %zmm3
	vmovaps	64(%rdi,%rax,4), %zmm4
	vmovdqa32	%zmm7, %zmm0
	vmulps	%zmm3, %zmm11, %zmm2
	vmulps	%zmm4, %zmm11, %zmm1
	vpsrld	$16, %zmm2, %zmm26
	vpternlogd	$202, %zmm26, %zmm1, %zmm0
	vpcmpw	$1, %zmm21, %zmm0, %k0
	movl	$-14332, %ebx
	vpbroadcastw	%ebx, %zmm1
	vpaddw	%zmm1, %zmm0, %zmm0
	vpsrlw	$3, %zmm0, %zmm0
	vpmovwb	%zmm0, %ymm0
	vmovdqu	%ymm0, (%r14,%rax)
